"""Planning before training: memory, batch and step-time estimates, fake-tensor traces, GPU specs, autobatch."""
