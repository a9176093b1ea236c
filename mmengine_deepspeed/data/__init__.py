"""The training data: samplers that skip and leave samples out, per-sample seeds in
workers, iterators created from saved streams, and the train loops that resume exactly
without reloading data."""
