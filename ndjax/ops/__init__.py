"""Hand-written operations that the partitioner cannot derive from the model alone."""
