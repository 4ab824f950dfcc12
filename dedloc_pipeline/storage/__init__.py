"""Where bytes live: the bucket's keys (``layout``), I/O with retries on any fsspec URL
(``bucket``, with ``retry``, ``s3`` and ``stats``), codecs for flat vectors (``codec``) and those
vectors as zarr arrays (``vector``). Knows nothing of models or rounds."""
