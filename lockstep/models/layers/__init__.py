"""lockstep.models.layers."""
