"""Serve the three flows as deployments named ``local`` (what ``make pretrain`` triggers).

    PREFECT_API_URL=http://127.0.0.1:4200/api python -m flows.serve
"""

from prefect import serve

from flows.evaluation import evaluate
from flows.pretraining import pretrain
from flows.tokenization import tokenize

if __name__ == "__main__":
    serve(tokenize.to_deployment("local"), pretrain.to_deployment("local"),
          evaluate.to_deployment("local"), limit=4)
