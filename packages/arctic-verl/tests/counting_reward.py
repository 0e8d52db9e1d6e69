"""verl reward function (``reward.custom_reward_function``) for the demo's counting task."""

from arctic_core.demo.task import CountingTask, Problem

TASK = CountingTask()
PROBLEMS = {problem.prompt: problem for problem in TASK.problems()}


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None, **kwargs) -> float:
    problem: Problem = PROBLEMS[ground_truth]
    return TASK.reward(problem, solution_str)
