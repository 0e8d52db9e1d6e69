"""verl reward function for a run that mixes the recipes' data sets: each row goes to its own
recipe's ``compute_score`` by ``data_source`` (a test fixture; each recipe's YAML names its own file)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from recipes.gsm8k import reward as gsm8k
from recipes.gsm8k.prepare_data import DATA_SOURCE as GSM8K
from recipes.long_context_qa import reward as qa
from recipes.long_context_qa.prepare_data import DATA_SOURCE as QA
from recipes.text_to_sql import reward as sql
from recipes.text_to_sql.prepare_data import DATA_SOURCE as SQL

SCORERS = {GSM8K: gsm8k.compute_score, SQL: sql.compute_score, QA: qa.compute_score}


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return SCORERS[data_source](data_source, solution_str, ground_truth, extra_info)
