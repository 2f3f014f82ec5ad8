"""Training a resolved job (meshtrain.job): `build` what a step runs on, `step` one step, `loop` the
run; `dry_run` the same build at any world size on fake tensors; `plan_check` the planner's word on it.

Import from the module that defines a name (`from meshtrain.train.build import build`): the package
itself imports nothing, so the `--nproc` launcher, which needs only the job's resolution, starts its
workers without first loading the parallel, compile and checkpoint stacks (seconds on a small machine)."""
