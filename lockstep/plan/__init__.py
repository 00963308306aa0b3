"""lockstep.plan."""
