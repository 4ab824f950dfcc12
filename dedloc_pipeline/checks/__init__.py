"""Every judgement of a volunteer's work: the rules that admit a shard, the screens, the
recomputation that verifies one, and the commit/reveal exchange that checks an aggregator."""
