"""Running things: the steps that launch processes and drive the library (calibration, ...)."""
