"""Measuring: operands, timing and verification of one solver on one problem. Imports
the solvers and the core; nothing here decides or stores."""
