"""Core types, the bottom layer above the kernels: the problem, layouts and memory
formats, precision, argument checks, the cost table as data and the version. Imports
nothing else of gemmconv."""
