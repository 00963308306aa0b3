"""lockstep.models."""
