"""The planner: from an aten op on DTensors to instructions (schema, dispatch, choice, plans, emit)."""
