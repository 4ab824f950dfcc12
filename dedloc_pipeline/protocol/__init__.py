"""What both sides read: the run and its config, the clock, the records a round is made of
(heartbeat, shard manifest, round view, CLOSE). Imports nothing above storage, trust and model."""
