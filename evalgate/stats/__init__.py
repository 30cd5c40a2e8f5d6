"""Pure numbers for paired comparisons: counts, exact tests, intervals, multiplicity, the A/A margin floor.

No policy and no words: the gate's rule (``evalgate.gate.rule``) uses these.
"""
