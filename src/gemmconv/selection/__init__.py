"""Selection: the find modes, dispatch, find, the find database, the calibration of
GPUs the cost table does not know, and the explanations of choices."""
