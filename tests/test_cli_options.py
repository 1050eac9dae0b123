"""The command line's engine options come from EngineConfig's fields: parsers only, no engine."""
import dataclasses
import subprocess
import sys

import pytest

from engine.cli import ONE_PROMPT, parser
from engine.config import EngineConfig, Tuning
from engine.options import dest, engine_config, field_comments, field_default, field_sections, flags, option_fields
from engine.server.serve import SERVER_DEFAULTS

FIELDS = option_fields()
TUNING = {f.name for f in dataclasses.fields(Tuning)}
COMMANDS = {"generate": ["--prompt", "hi"], "chat": [], "serve": []}
PER_COMMAND = {"generate": ONE_PROMPT, "chat": ONE_PROMPT, "serve": SERVER_DEFAULTS}


def _parse(command, *argv):
    return parser().parse_args([command, *COMMANDS[command], *argv])


@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_is_a_flag_whose_default_is_the_fields(command):
    args = _parse(command)
    for f in FIELDS:
        expected = PER_COMMAND[command].get(f.name, (field_default(f),))[0]
        assert getattr(args, dest(f.name)) == expected, f.name
    assert engine_config(args) == EngineConfig.of(**{name: value for name, (value, _) in PER_COMMAND[command].items()})


@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_has_a_flag_in_the_help(command):
    top = parser()
    sub = next(a for a in top._actions if a.dest == "command").choices[command]
    text = sub.format_help()
    listed, tuning = text.split("tuning (")
    for f in FIELDS:
        assert (f.name in tuning) if f.name in TUNING else (flags(f.name)[0] in listed), f.name


def test_the_per_command_defaults_say_why_in_help():
    subs = next(a for a in parser()._actions if a.dest == "command").choices
    for command, defaults in PER_COMMAND.items():
        for name, (value, why) in defaults.items():
            action = next(a for a in subs[command]._actions if a.dest == dest(name))
            assert action.default == value
            assert name in TUNING or (why in action.help and "%(default)s" in action.help)


def test_help_comes_from_the_fields_comment_and_groups_from_the_sections():
    comments, sections = field_comments(), field_sections()
    assert comments["block_size"] == "tokens per KV page"
    assert "model" not in comments and "tuning" in comments
    assert sections["model"] == sections["block_size"] == "model and cache"
    assert sections["speculative"] == sections["ngram_max_n"] == "speculative decoding"
    assert len({f.name for f in dataclasses.fields(EngineConfig)}) <= 36      # a config a user can read


def test_the_help_lists_user_options_one_a_line_and_tuning_in_one_line():
    text = parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "model and cache:" in text and "speculative decoding:" in text and "tuning (" in text
    assert "--no-decode-attention" not in text.split("tuning (")[0]
    assert "decode_attention_splits" in text.split("tuning (")[1]


def test_tuning_fields_are_flags_and_options_of_the_engine_config():
    args = _parse("serve", "--no-native-launch", "--decode-attention-splits", "4", "--max-num-seqs", "8")
    config = engine_config(args)
    assert not config.tuning.native_launch and config.tuning.decode_attention_splits == 4
    assert config.max_num_seqs == 8 and config.tuning.grammar_node == "native"
    assert EngineConfig.of(native_launch=False, depth=1) == EngineConfig(depth=1, tuning=Tuning(native_launch=False))
    assert config.with_options(debug_sync=True, depth=1).tuning.debug_sync
    with pytest.raises(TypeError, match="no_such_field"):
        EngineConfig.of(no_such_field=1)
    with pytest.raises(ValueError, match="decode_attention_splits"):
        EngineConfig.of(decode_attention_splits=3)


@pytest.mark.parametrize("argv, field, value", [
    (["--num-draft-tokens", "5"], "num_speculative_tokens", 5),
    (["--num-speculative-tokens", "5"], "num_speculative_tokens", 5),
    (["-tp", "2"], "tensor_parallel_size", 2),
    (["--tp-timeout", "9"], "tp_timeout_s", 9.0),
    (["--grammar-compile-timeout", "3"], "grammar_compile_timeout_s", 3.0),
    (["--draft-masks"], "guided_draft_masks", True),
    (["--forced-drafts"], "guided_forced_drafts", True),
    (["--enforce-eager"], "enforce_eager", True),
    (["--no-guided"], "guided", False),
    (["--speculative", "ngram"], "speculative", "ngram"),
    (["--max-num-seqs", "32", "--max-model-len", "1024"], "max_model_len", 1024),
    (["--engine-seed", "7"], "seed", 7),
])
def test_flags_kept_from_before_still_set_their_field(argv, field, value):
    for command in COMMANDS:
        config = engine_config(_parse(command, *argv))
        assert getattr(config.tuning if field in TUNING else config, field) == value


def test_generate_keeps_seed_for_the_request():
    args = _parse("generate", "--seed", "3")
    assert args.seed == 3 and engine_config(args).seed == 0


def test_bad_choice_is_refused():
    with pytest.raises(SystemExit):
        _parse("serve", "--speculative", "medusa")


def test_the_server_does_not_import_the_cli():
    code = "import sys, engine.server.serve; assert 'engine.cli' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
