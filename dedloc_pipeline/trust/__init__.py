"""Who may write what: volunteers' signing keys and the organizer's roster (``identity``), and
least-privilege bucket rights per volunteer (``policy``)."""
