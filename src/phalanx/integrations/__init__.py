"""Other frameworks' training loops under phalanx (``phalanx[deepspeed]``, ``phalanx[megatron]``): their own
checkpoints made atomic and verified, a save on SIGTERM before the supervisor's grace period ends, and each
step's figures reported as the built-in recipe reports them (integrations/loop.py). Each framework's module
says how its script opts in with a few lines."""
