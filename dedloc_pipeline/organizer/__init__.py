"""The organizer's side: the scheduler's round loop, its judgement of a round's shards, the
referee of the aggregators' exchanges, the lease, the ledger that commits, and repair."""
