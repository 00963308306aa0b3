"""lockstep.quant."""
