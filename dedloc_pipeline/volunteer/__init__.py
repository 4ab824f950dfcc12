"""The volunteer's side: the worker and what it drives (the state it follows, its accumulation's
transfers, when it uploads, the checks before it joins), and the volunteer aggregator's role."""
