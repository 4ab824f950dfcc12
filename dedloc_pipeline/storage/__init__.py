"""Where bytes live: the bucket's keys (``layout``), I/O with retries on any fsspec URL
(``bucket``), and compressed vectors as zarr arrays (``codec``). Knows nothing of models or rounds."""
