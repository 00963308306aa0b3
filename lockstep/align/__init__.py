"""lockstep.align."""
