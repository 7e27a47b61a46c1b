"""Step costs for the speculative-decoding gate that do not depend on timing: tests choose what
verification costs instead of measuring it."""
from ember_cupy.engine.step_costs import StepCosts


class FreeVerification(StepCosts):
    """A step costs the same whatever its size: the gate keeps every draft."""
    measured = True

    def record(self, num_tokens, seconds):
        pass

    def seconds(self, num_tokens):
        return 1.0


class FreeDrafting(FreeVerification):
    """A draft model's step costs nothing: with FreeVerification, the gate keeps every draft."""

    def seconds(self, num_tokens):
        return 0.0
