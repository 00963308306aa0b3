"""lockstep.eval: pure pass@k arithmetic (the evaluation run itself is `lockstep.rl.evaluate`)."""
