"""HumanEval: problems, the task (prompting and scoring), the executor self-test, the sandbox, pass@k."""
