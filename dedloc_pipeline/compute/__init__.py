"""The numerics both sides run bit for bit: a volunteer's accumulation, a part's reduction and
optimizer step, robust aggregation. Whoever runs them on whatever machine gets the same bytes."""
