"""dedloc-pipeline."""
