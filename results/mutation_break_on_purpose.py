"""Deliberate errors (a)-(h) of results/mutation.md: each applied to a scratch copy of the tree (never the shared
one), the concept test file run, the file restored. Usage: python results/mutation_break_on_purpose.py COPY [a b ...]"""
import subprocess
import sys
from pathlib import Path

ROOT = Path(sys.argv[1])
LOSS = "moh_lightning/diffusion/gaussian_diffusion.py"
FID = "moh_lightning/metrics/fidelity.py"
LOSS_TESTS, FID_TESTS = "tests/diffusion/test_gaussian_diffusion.py", "tests/metrics/test_fidelity.py"
CASES = {  # name: (file, [(original text, broken text)], test file)
    "a": (LOSS, [("_discretized_gaussian_log_likelihood(x0, model_mean",
                  "_discretized_gaussian_log_likelihood(x_t, model_mean")], LOSS_TESTS),
    "b": (LOSS, [("(centered + 1.0 / 255.0)", "(centered + 2.0 / 255.0)"),
                 ("(centered - 1.0 / 255.0)", "(centered - 2.0 / 255.0)")], LOSS_TESTS),
    "c": (LOSS, [("return torch.where(t == 0, nll, kl)", "return kl")], LOSS_TESTS),
    "d": (LOSS, [("torch.log(torch.cat([posterior_variance[1:2], posterior_variance[1:]]))",
                  "torch.log(posterior_variance)")], LOSS_TESTS),
    "e": (LOSS, [("x0, x_t, t, eps.detach(), model_output", "x0, x_t, t, eps, model_output")], LOSS_TESTS),
    "f": (FID, [('inception_score(generated["logits_unbiased"])', 'inception_score(generated["2048"])')], FID_TESTS),
    # torch-fidelity's samples_shuffle=True: np.random.RandomState(2020).permutation before the splits
    "g": (FID, [("log_probs = logits.double().log_softmax(1)\n",
                 "log_probs = logits.double().log_softmax(1)\n"
                 "    log_probs = log_probs[np.random.RandomState(2020).permutation(len(log_probs))]\n")], FID_TESTS),
    # torch-fidelity's isc_splits=10: ten equal splits whatever N
    "h": (FID, [("for chunk in log_probs.split(split_size):",
                 "for chunk in [log_probs[i * len(log_probs) // 10:(i + 1) * len(log_probs) // 10]"
                 " for i in range(10)]:")], FID_TESTS),
}
for name in sys.argv[2:] or CASES:
    path, edits, tests = CASES[name]
    source = ROOT / path
    original = source.read_text()
    broken = original
    for old, new in edits:
        assert broken.count(old) == 1, (name, old)
        broken = broken.replace(old, new)
    source.write_text(broken)
    try:
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider",
                                 "-o", "addopts=", "-rf", tests], cwd=ROOT, capture_output=True, text=True)
    finally:
        source.write_text(original)
    failed = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    summary = result.stdout.strip().splitlines()[-1]
    print(f"({name}) rc={result.returncode} {summary}")
    for line in failed:
        print("    ", line[:200])
    sys.stdout.flush()
