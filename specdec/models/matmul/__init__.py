"""How a model's matrices are multiplied: the hook a model gets (choice.py), the compiled
row-invariant one over prepared panels (prepared.py) with whole layers as one call (fused.py),
and the timed F.linear table (linear.py)."""
