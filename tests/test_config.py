"""The config tree: the command line and TOML files are two views of it."""
import pytest

from meshtron import Config
from meshtron.command_line import parser, preset_training
from meshtron.config import SECTIONS, ConfigError
from meshtron.distributed import choices
from meshtron.distributed.data_parallel import DTYPES
from meshtron.distributed.pipeline_parallel import SCHEDULES
from meshtron.models import PRESETS, presets


def test_print_config_reads_back_as_the_same_config(tmp_path, capsys):
    argv = ["--model", "llama-tiny", "--tp", "2", "--sp", "--steps", "7", "--lr", "3e-4", "--no-loss-parallel",
            "--data", "corpus.txt", "--eval-steps", "3"]
    with pytest.raises(SystemExit) as e:
        Config.from_args(argv + ["--print-config"], models=PRESETS)
    assert e.value.code == 0
    (tmp_path / "run.toml").write_text(capsys.readouterr().out)
    assert Config.from_args(["--config", str(tmp_path / "run.toml")], models=PRESETS) == \
        Config.from_args(argv, models=PRESETS)


def test_flags_override_the_file(tmp_path):
    (tmp_path / "run.toml").write_text('[parallel]\ntp = 2\nsp = true\n[training]\nsteps = 7\nlr = 1\n')
    c = Config.from_args(["--config", str(tmp_path / "run.toml"), "--steps", "9"], models=PRESETS)
    assert (c.parallel.tp, c.parallel.sp, c.training.steps, c.training.lr) == (2, True, 9, 1.0)


@pytest.mark.parametrize("text,msg", [
    ("[paralel]\ntp = 2\n", "unknown section [paralel]"),
    ("[parallel]\ntpp = 2\n", "[parallel] has no field 'tpp'"),
    ("[parallel]\ntp = \"2\"\n", "[parallel] tp = '2' must be a int"),
    ("[parallel]\nsp = 1\n", "[parallel] sp = 1 must be a bool"),
    ("[parallel]\npp_schedule = \"chimera\"\n", "pp_schedule = 'chimera' must be one of"),
    ("[model]\nmodel = \"gpt5\"\n", "model = 'gpt5' must be one of"),
    ("[parallel\n", "--config"),
])
def test_bad_config_files_name_the_problem(tmp_path, text, msg):
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(ConfigError, match=msg.replace("[", "\\[").replace("]", "\\]")):
        Config.from_args(["--config", str(tmp_path / "bad.toml")], models=PRESETS)


def test_every_flag_has_help_and_shows_its_default():
    # once: a doc that states its default is not followed by the field's "(default: None)" (issue 57, point 6)
    for action in parser(SECTIONS, models=PRESETS)._actions:
        if action.dest != "help":
            assert action.help, action.dest
            if action.dest not in ("config", "print_config"):
                assert action.help.count("default:") == 1, action.help


def test_learning_rate_and_warmup_come_from_the_preset_unless_given(tmp_path):
    # a 3B Llama at the tiny models' 1e-3 spiked to loss 22 on its fifth step: each
    # preset carries its family's schedule, and a flag or a file still wins
    def schedule(*argv):
        t = Config.from_args(list(argv), models=PRESETS).training
        return t.lr, t.warmup
    assert schedule("--model", "llama-3B") == (3e-4, 2000)
    assert schedule("--model", "1.3B") == (2e-4, 375)
    assert schedule("--model", "tiny") == (1e-3, 10)
    assert schedule("--model", "llama-3B", "--lr", "1e-4", "--warmup", "5") == (1e-4, 5)
    (tmp_path / "run.toml").write_text('[model]\nmodel = "llama-1B"\n[training]\nwarmup = 7\n')
    assert schedule("--config", str(tmp_path / "run.toml")) == (3e-4, 7)
    assert all(set(PRESETS[m].training) == set(PRESETS[m].presets) for m in PRESETS)


def test_the_names_the_command_line_offers_are_those_the_code_maps():
    # issue 44: the flags are checked before torch loads, so their names live in a torch-free
    # module; the tables that map them to torch's objects are keyed by the same names
    assert tuple(DTYPES) == choices.DTYPES and tuple(SCHEDULES) == choices.SCHEDULES
    assert choices.SPLIT_BACKWARD <= choices.MULTI_STAGE <= set(choices.SCHEDULES)


def test_the_torch_free_preset_index_agrees_with_the_registry():
    # issue 44: the recipe parses with meshtron.models.presets; tests and benchmarks pass the registry
    assert list(presets.TRAINING) == list(PRESETS)
    assert all(preset_training(presets.TRAINING, m) == preset_training(PRESETS, m) for m in PRESETS)
    assert parser(SECTIONS, models=presets.TRAINING).format_help() == parser(SECTIONS, models=PRESETS).format_help()
    assert Config.from_args(["--model", "llama-3B"], models=presets.TRAINING) == \
        Config.from_args(["--model", "llama-3B"], models=PRESETS)


def test_dtype_defaults_to_bf16_on_gpus_and_fp32_on_the_cpu():
    c = Config.from_args([], models=PRESETS)
    assert c.parallel.dtype is None   # left to the device the run lands on
    assert c.on_device("cuda").parallel.dtype == "bf16"
    assert c.on_device("cpu").parallel.dtype == "fp32"
    assert c.on_device("cuda").parallel.reduce_dtype == "fp32"
    # a choice the user made stands on either device
    assert Config.from_args(["--dtype", "fp32"], models=PRESETS).on_device("cuda").parallel.dtype == "fp32"
    assert Config.from_args(["--dtype", "bf16"], models=PRESETS).on_device("cpu").parallel.dtype == "bf16"
    # FP8's matmuls sit inside bf16 compute, emulated on the CPU too
    assert Config.from_args(["--fp8", "tensorwise"], models=PRESETS).on_device("cpu").parallel.dtype == "bf16"


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_fp8_with_another_compute_dtype_is_refused(dtype):
    c = Config.from_args(["--fp8", "tensorwise", "--dtype", dtype], models=PRESETS)
    with pytest.raises(ConfigError, match=f"--fp8 .* leave out --dtype {dtype}"):
        c.validate(1)
