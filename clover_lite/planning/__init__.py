"""Will it fit: the memory plan for a model on a GPU, before anything is loaded."""
