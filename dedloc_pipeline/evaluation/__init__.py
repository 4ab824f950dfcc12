"""How good a committed state is: held-out MLM loss, Bengali downstream tasks, Hugging Face export."""
