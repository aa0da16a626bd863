"""The lossless speculative decoder, proposers, metrics, the benchmark runner and reports."""
