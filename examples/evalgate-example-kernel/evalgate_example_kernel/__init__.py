"""An example kernel package for evalgate: see declarations.py (what evalgate reads first), cpu.py and b200.py."""
