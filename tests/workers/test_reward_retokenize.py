"""A reward model whose tokenizer and chat template differ from the policy's: the ``reward_model``
component decodes the response and renders the prompt's messages + the response with the reward
model's template; the Megatron reward worker's scores of that input equal transformers'
``LlamaForSequenceClassification`` logits on the re-tokenised text (fp32, <= 1e-4), at TP1 and TP2, packed
and padded."""

import pytest
import torch

from rlmega.data import build_char_tokenizer
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.rewards import RewardModelScorer, ScoreItem, same_tokenization

ATOL = 1e-4
TIMEOUT_S = 240
REWARD_TEMPLATE = (  # not the policy's: a system line, roles as words, a newline after each message
    "<|system|>rate the answer{{ eos_token }}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}{{ eos_token }}"
)
PROMPTS = ["3+5=", "12+7=", "9+9=", "0+4=", "6+1=", "8+8="]
RESPONSES = ["8", "19", "1x8", "4", "", "61"]


def reward_tokenizer():
    """A character tokenizer with another vocabulary order (every character's id differs from the
    policy's) and another chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rlmega.data.tokenizer import CHARACTERS, ROLE_TOKENS, SPECIAL_TOKENS

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(reversed(CHARACTERS)))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<unk>",
                                        additional_special_tokens=list(ROLE_TOKENS))
    tokenizer.chat_template = REWARD_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    directory = tmp_path_factory.mktemp("reward")
    tokenizer = reward_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    config._attn_implementation = "eager"
    model = AutoModelForSequenceClassification.from_config(config).float().eval()
    with torch.no_grad():  # scores of order 1, so a wrong read position shows
        model.score.weight.normal_(0.0, 0.5)
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def items():
    """What the policy (the character tokenizer and its template) produced."""
    policy = build_char_tokenizer()
    out = []
    for prompt, response in zip(PROMPTS, RESPONSES):
        messages = [{"role": "user", "content": prompt}]
        text = policy.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = policy(text, add_special_tokens=False)["input_ids"]
        response_ids = policy.encode(response, add_special_tokens=False) + [policy.eos_token_id]
        decoded = policy.decode(response_ids, skip_special_tokens=True)
        out.append(ScoreItem("rlmega/arithmetic", decoded, "0", messages=messages, prompt_token_ids=prompt_ids,
                             response_token_ids=response_ids))
    return out


class _Worker:
    """The reward worker of this rank as the component's model."""

    def __init__(self, worker):
        self.worker = worker

    def score(self, batch):
        return self.worker.compute_scores(batch)

    def shutdown(self):
        pass


def _body(rank, world_size, layout, reward_dir):
    from transformers import AutoTokenizer

    from rlmega.models import model_spec_from_hf
    from rlmega.workers.config import BatchingConfig, WorkerConfig
    from rlmega.workers.worker import MegatronWorker

    initialize(layout)
    spec = model_spec_from_hf(reward_dir)
    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    scores = {}
    for packing in (True, False):  # a 48-token budget: several micro-batches, padded rows when not packed
        config = WorkerConfig(role="reward", batching=BatchingConfig(packing=packing, max_tokens_per_microbatch=48))
        worker = MegatronWorker(spec, layout, config, hf_dir=reward_dir)
        outcomes = RewardModelScorer(_Worker(worker), tokenizer, retokenize=True).score_items(items())
        assert all(o.status == "ok" for o in outcomes), [o.message for o in outcomes]
        scores[packing] = torch.tensor([o.score for o in outcomes])
    destroy()
    return scores


def hf_scores_of_retokenised(reward_dir) -> torch.Tensor:
    """transformers' logits on the reward tokenizer's rendering of prompt + response, one padded batch."""
    from transformers import AutoModelForSequenceClassification

    tokenizer = reward_tokenizer()
    model = AutoModelForSequenceClassification.from_pretrained(reward_dir, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    sequences = []
    for prompt, response in zip(PROMPTS, RESPONSES):
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        assert text == f"<|system|>rate the answer<eos>user: {prompt}\nassistant: {response}\n<eos>"
        sequences.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    width = max(map(len, sequences))
    tokens = torch.full((len(sequences), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(tokens)
    for row, ids in enumerate(sequences):
        tokens[row, :len(ids)], mask[row, :len(ids)] = torch.tensor(ids), 1
    with torch.no_grad():
        return model(tokens, attention_mask=mask).logits[:, 0]


def test_the_tokenizers_differ_and_the_policys_ids_would_be_wrong():
    policy, reward = build_char_tokenizer(), reward_tokenizer()
    assert not same_tokenization(policy, reward)
    assert policy.convert_tokens_to_ids("8") != reward.convert_tokens_to_ids("8")


@pytest.mark.parametrize("layout_args", [dict(world_size=1), dict(tp=2, world_size=2)], ids=["tp1", "tp2"])
def test_retokenised_scores_match_transformers(reward_dir, layout_args):
    layout = ParallelLayout(**layout_args)
    expected = hf_scores_of_retokenised(reward_dir)
    assert expected.abs().min() > 1e-2
    for scores in run_on_ranks(_body, layout.world_size, timeout_s=TIMEOUT_S, args=(layout, str(reward_dir))):
        for packing, got in scores.items():
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=f"packing={packing}")
