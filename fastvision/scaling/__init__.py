"""Scaling studies: sweeps over GPU counts, reports, the step-time simulator and its validation."""
