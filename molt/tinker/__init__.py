"""molt.tinker: the imperative face. `python -m molt.tinker serve [overrides]` serves the Tinker API
(`forward_backward`, `optim_step`, `sample`, ... from the pinned `tinker` SDK) over the engines and
trainer ranks a run would start from the same spec, without the loop: the client's program is the loop.
It is a new face over the wings (it imports the driver's pieces, the engines, the trainer ranks and the
algo losses); none of them imports it. docs/tinker.md: what is served, what is refused, how to run it.
"""


class Refused(ValueError):
    """A request asks for something this service does not serve; the message names it (HTTP 400)."""
