"""The command line: help that explains, one-line errors with exit code 2, ``python -m converters``."""

import subprocess
import sys

from rlmega.cli.main import main


def test_help_explains_each_conversion(capsys):
    assert main(["convert", "--help"]) == 0
    text = capsys.readouterr().out
    for word in ("mcore-to-hf", "hf-to-mcore", "verify", "torch_dist", "renamed into place"):
        assert word in text
    for conversion in ("mcore-to-hf", "hf-to-mcore", "verify"):
        assert main(["convert", conversion, "--help"]) == 0
    assert "--bucket-size" in capsys.readouterr().out


def test_error_is_one_line_with_exit_code_2(hf_models, tmp_path, capsys):
    code = main(["convert", "mcore-to-hf", str(tmp_path / "nothing"), str(tmp_path / "out"), "--hf-base", str(hf_models["llama"])])
    error = capsys.readouterr().err
    assert code == 2 and error.count("\n") == 1 and "does not exist" in error
    assert not (tmp_path / "out").exists()


def test_bad_size_is_a_usage_error(capsys):
    assert main(["convert", "mcore-to-hf", "a", "b", "--hf-base", "c", "--bucket-size", "lots"]) == 2
    assert "not a size" in capsys.readouterr().err


def test_python_dash_m_converters():
    done = subprocess.run([sys.executable, "-m", "converters", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "mcore-to-hf" in done.stdout
