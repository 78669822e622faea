"""What the command line and the benchmarks print: usage errors, progress bars and the
warning before a long CPU run."""
