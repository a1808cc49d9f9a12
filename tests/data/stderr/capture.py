"""Re-create the real stderr texts in this folder on CPU: `python tests/data/stderr/capture.py [case ...]`.

Each case runs in its own subprocess; its stderr is saved verbatim as <case>.txt. The transcribed_cuda_*.txt
files need a GPU and are not produced here (see tests/test_diagnose.py).
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

OUT = Path(__file__).resolve().parent
REPO = OUT.parents[2]
PRE = textwrap.dedent("""
    import sys, tempfile, torch
    sys.path.insert(0, {repo!r})
    from core.demo.toy import build_tiny_model
    from transformers import AutoModelForCausalLM
    d = build_tiny_model(tempfile.mkdtemp(), 'llama')
    model = AutoModelForCausalLM.from_pretrained(d)
    V = model.config.vocab_size
""")
CASES = {
    "cpu_label_out_of_vocab": PRE
    + "ids = torch.randint(0, V, (2, 16)); labels = ids.clone(); labels[0, 5] = V + 48\nmodel(input_ids=ids, labels=labels).loss.backward()\n",
    "cpu_embedding_index_out_of_range": PRE
    + "ids = torch.randint(0, V, (2, 16)); ids[1, 3] = V + 7\nmodel(input_ids=ids, labels=ids).loss.backward()\n",
    "cpu_alloc_rlimit": textwrap.dedent("""
    import resource, torch
    resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))
    x = torch.empty(8 * 2**30, dtype=torch.uint8)
    """),
    "missing_module": "import sys\nsys.path.insert(0, {repo!r})\nimport torch\nimport flash_attn_cockpit_absent\n",
    "model_folder_not_found": "from transformers import AutoModelForCausalLM\nAutoModelForCausalLM.from_pretrained('/tmp/no-such-model-folder/Llama-3-8B')\n",
    "data_file_not_found": "from datasets import load_dataset\nload_dataset('json', data_files='/tmp/no-such-dir/train.jsonl')\n",
    "dataloader_worker_killed": textwrap.dedent("""
    import os, signal, torch
    from torch.utils.data import DataLoader, Dataset
    class D(Dataset):
        def __len__(self): return 8
        def __getitem__(self, i):
            if i == 3: os.kill(os.getpid(), signal.SIGKILL)
            return torch.zeros(4)
    if __name__ == '__main__':
        for b in DataLoader(D(), batch_size=2, num_workers=1): pass
    """),
    "healthy_lora_trainer_run": textwrap.dedent("""
    import sys, tempfile, torch
    sys.path.insert(0, {repo!r})
    torch.set_num_threads(2)
    from core.demo.toy import build_tiny_model, build_tokenizer
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    from peft import LoraConfig, get_peft_model
    from datasets import Dataset
    d = build_tiny_model(tempfile.mkdtemp(), 'llama')
    lora = LoraConfig(r=4, target_modules=['q_proj', 'v_proj'], task_type='CAUSAL_LM')
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(d), lora)
    tok = build_tokenizer()
    rows = [tok('hello world number %d' % i) for i in range(16)]
    ds = Dataset.from_list([{'input_ids': r['input_ids'], 'labels': r['input_ids']} for r in rows])
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=4, per_device_train_batch_size=1,
                             logging_steps=1, report_to=[], save_strategy='no', use_cpu=True, learning_rate=2e-4)
    Trainer(model=model, args=args, train_dataset=ds).train()
    """),
}
env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
for name, code in CASES.items():
    if len(sys.argv) > 1 and name not in sys.argv[1:]:
        continue
    code = code.replace("{repo!r}", repr(str(REPO)))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    (OUT / f"{name}.txt").write_text(p.stderr)
    print(name, p.returncode, p.stderr.strip().splitlines()[-1:])
