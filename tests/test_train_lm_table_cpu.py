"""examples/train_lm.py's summary table names the steps its final train loss averages: fewer than FINAL_WINDOW when
--steps is smaller (a first-time-user trial found "last 20 steps" over a 5-step run)."""
from repo_scripts import load_script


def _train_lm():
    return load_script("examples/train_lm.py", "train_lm_example")


def _result(steps):
    return {"backend": "sdpa", "first_loss": 5.8, "final_train_loss": 5.1, "final_window": steps, "val_loss": 5.2,
            "tokens_per_s": None, "peak_memory_gib": None}


def test_header_names_the_steps_averaged():
    train_lm = _train_lm()
    short = train_lm.markdown_table([_result(5), _result(5)])
    assert "mean of last 5 steps" in short.splitlines()[0]
    full = train_lm.markdown_table([_result(train_lm.FINAL_WINDOW)])
    assert f"mean of last {train_lm.FINAL_WINDOW} steps" in full.splitlines()[0]
