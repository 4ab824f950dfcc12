"""Prefect flows: thin wiring of dedloc_pipeline's library calls (tokenize, pretrain, evaluate)."""
