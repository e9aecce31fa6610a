"""Planning a training run's layout from the model, the curriculum and the hardware (no GPU needed).

- `hardware`: GPUs and networks (datasheet, measured or assumed numbers) and the cluster;
- `model_facts`: the model's parameters as the parallel engine places them, read off a meta build;
- `memory`: bytes per GPU of a step under a layout and a checkpointing policy;
- `step_time`: seconds of a step from FLOPs, bytes and link bandwidths;
- `search`: every layout the model allows on a cluster, the fastest that fits;
- `report`: the text `moe-lc plan RECIPE --gpus N` prints.

The model behind the numbers, its assumptions and where it is calibrated: docs/parallelism.md,
"Planning a layout".
"""
