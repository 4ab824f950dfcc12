"""The collaboration: run config and state, gradient shards, the volunteer's worker, and the round
engine (scheduler, aggregators, optimizer, robust estimators). Never imports monitoring or evaluation."""
