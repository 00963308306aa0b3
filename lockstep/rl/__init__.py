"""lockstep.rl."""
