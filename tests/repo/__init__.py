"""What ships beside the package, run as a user runs it: README, docs, examples, benchmarks."""
