"""Capacity planning: what a collaboration will move and cost before it runs (prices, the request
model, the estimate), from the run's own config and layout. Torch-free."""
