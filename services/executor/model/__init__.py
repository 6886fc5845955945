"""The model and what it computes over: a step's rows (batch.py) and the device pools
(pools.py). It imports nothing else of the executor, so the executor's runner, service
and weights loader build on it and never the other way round."""
