"""DTN against its LayerNorm twin on the CPU demo, over several seeds.

Trains the demo detector (``tools/demo.py``) with PVT-Tiny-DTN and with its LayerNorm twin
(``configs/demo/*_ln_*.py``: the same model, data and schedule with DTN off) for each seed, with
``--pretrain`` also from the backbone pretrained as a classifier on shape crops, and reports each
AP as mean +- standard deviation over the seeds, and DTN's gain over LayerNorm as the mean +- std
of the per-seed differences (same seed, same data). The paper's counterpart is its Table 11
(COCO, RetinaNet and Mask R-CNN 1x, PVT-Tiny), which needs GPUs.

Every training is one ``tools/demo.py`` process with ``--threads`` threads (default 1: the AP
depends on the thread count, not on the machine's cores); ``--jobs`` of them run at once (default:
the cores divided by the threads). Finished trainings are reused when run again with the same
settings, so an interrupted comparison resumes.

Writes ``comparison.json``, ``comparison.md`` (the table) and ``comparison.png`` (bar chart with
error bars and each seed's value) to the work dir.

Usage::

    python tools/demo_compare.py                       # Mask R-CNN, 3 seeds, from scratch
    python tools/demo_compare.py --pretrain            # and from the pretrained backbone
    python tools/demo_compare.py --model retinanet --seeds 5
"""
import argparse
import json
import os
import os.path as osp
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

sys.path.insert(0, osp.dirname(osp.abspath(__file__)))
import demo  # noqa: E402  (tools/demo.py)

NORMS = ('dtn', 'ln')
TASKS = {'mask_rcnn': ('bbox', 'segm'), 'retinanet': ('bbox', )}
STARTS = {'from scratch': 'from_scratch', 'pretrained': 'pretrained'}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='DTN against its LayerNorm twin on the CPU demo, over several seeds.')
    parser.add_argument('--model', choices=demo.MODELS, default='mask_rcnn')
    parser.add_argument('--seeds', type=int, default=3, help='seeds 0 .. N-1 (default: 3)')
    parser.add_argument('--pretrain', action='store_true',
                        help='also train from the backbone pretrained as a classifier')
    parser.add_argument('--iters', type=int, default=None,
                        help="detector iterations (default: the config's)")
    parser.add_argument('--pretrain-iters', type=int, default=None,
                        help="classifier iterations (default: the classifier config's)")
    parser.add_argument('--threads', type=int, default=1, help='threads of each training')
    parser.add_argument('--jobs', type=int, default=None,
                        help='trainings at once (default: the cores divided by --threads)')
    parser.add_argument('--work-dir', default=None,
                        help='default: work_dirs/compare_<model>')
    parser.add_argument('--data-root', default=osp.join(demo.ROOT, 'data', 'synthetic_shapes'))
    parser.add_argument('--pretrain-data-root',
                        default=osp.join(demo.ROOT, 'data', 'shape_crops'))
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.threads < 1 or (args.jobs is not None and args.jobs < 1):
        parser.error('--seeds, --threads and --jobs must be >= 1')
    if args.jobs is None:
        args.jobs = max(1, len(os.sched_getaffinity(0)) // args.threads)
    args.work_dir = osp.abspath(args.work_dir or
                                osp.join(demo.ROOT, 'work_dirs', f'compare_{args.model}'))
    return args


def run_dir(args, norm, seed):
    return osp.join(args.work_dir, norm, f'seed_{seed}')


def demo_command(args, norm, seed, start):
    """The ``tools/demo.py`` command of one training, and the file its metrics end up in."""
    cmd = [sys.executable, osp.join(demo.ROOT, 'tools', 'demo.py'), '--model', args.model,
           '--norm', norm, '--seed', str(seed), '--num-vis', '0', '--reuse',
           '--data-root', args.data_root]
    if args.iters is not None:
        cmd += ['--iters', str(args.iters)]
    if start == 'from scratch':  # a single run: the work dir is its training's
        return cmd + ['--work-dir', osp.join(run_dir(args, norm, seed), 'from_scratch')]
    cmd += ['--pretrain', 'only', '--pretrain-data-root', args.pretrain_data_root,
            '--work-dir', run_dir(args, norm, seed)]
    if args.pretrain_iters is not None:
        cmd += ['--pretrain-iters', str(args.pretrain_iters)]
    return cmd


def run(args, norm, seed, start):
    """One training (a ``tools/demo.py`` process, its output in ``demo.log``); its metrics."""
    cmd = demo_command(args, norm, seed, start)
    folder = osp.join(run_dir(args, norm, seed), STARTS[start])
    os.makedirs(folder, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    with open(osp.join(folder, 'demo.log'), 'w') as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                              cwd=demo.ROOT)
    if proc.returncode:
        raise RuntimeError(f'{" ".join(cmd)} failed with exit code {proc.returncode}; '
                           f'its output: {log.name}')
    with open(osp.join(folder, 'result.json')) as f:
        return json.load(f)['result']


def summarize(values):
    """Mean and sample standard deviation (0 for a single value) of ``values``."""
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0


def compare(results, tasks):
    """Per start and task: each norm's AP (%) over the seeds, and DTN minus LN seed by seed.

    ``results``: ``{(start, norm, seed): COCO metrics}``. Returns ``{start: {task: {'dtn': [...],
    'ln': [...], 'difference': [...]}}}`` with the values in seed order.
    """
    table = {}
    for start in dict.fromkeys(s for s, _, _ in results):
        seeds = sorted({seed for s, _, seed in results if s == start})
        table[start] = {}
        for task in tasks:
            # CocoMetric gives no AP where the model detects nothing at all: AP 0
            ap = {norm: [round(100 * results[start, norm, seed].get(f'coco/{task}_mAP', 0.0), 2)
                         for seed in seeds] for norm in NORMS}
            ap['difference'] = [round(d - n, 2) for d, n in zip(ap['dtn'], ap['ln'])]
            table[start][task] = ap
    return table


def format_markdown(table):
    """The comparison as a Markdown table: AP mean +- std per norm, and the difference."""
    lines = ['| Start | AP | LayerNorm | DTN | DTN - LN |', '| --- | --- | ---: | ---: | ---: |']
    for start, tasks in table.items():
        for task, ap in tasks.items():
            cells = ['{:.1f} ± {:.1f}'.format(*summarize(ap[k])) for k in ('ln', 'dtn')]
            cells.append('{:+.1f} ± {:.1f}'.format(*summarize(ap['difference'])))
            lines.append(f'| {start} | {task} | ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def plot(table, title, out_file):
    """Bars of the mean AP per norm with the standard deviation as error bars, and each seed's AP
    as a dot, grouped by start and task; written to ``out_file`` (PNG)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    groups = [(start, task, ap) for start, tasks in table.items() for task, ap in tasks.items()]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(groups), 4))
    width, colours = 0.38, {'ln': '#8c8c8c', 'dtn': '#d62728'}
    for g, (start, task, ap) in enumerate(groups):
        for i, norm in enumerate(('ln', 'dtn')):
            x = g + (i - 0.5) * width
            mean, std = summarize(ap[norm])
            ax.bar(x, mean, width, yerr=std, capsize=4, color=colours[norm],
                   label={'ln': 'LayerNorm', 'dtn': 'DTN'}[norm] if g == 0 else None)
            ax.scatter([x] * len(ap[norm]), ap[norm], s=12, color='black', zorder=3)
    ax.set_xticks(range(len(groups)), [f'{task}\n{start}' for start, task, _ in groups])
    ax.set_ylabel('COCO AP (%)')
    ax.set_title(title + '\nmean ± std (bars), each seed (dots)', fontsize=9)
    ax.grid(axis='y', alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_file, dpi=100)
    plt.close(fig)
    return out_file


def prepare_data(args, cfg):
    """Write the datasets once, before the trainings that share them start (``cfg``: the
    detector's demo config)."""
    import mmdtn  # noqa: F401
    from mmdtn.datasets import generate_shape_crops, generate_shapes_dataset

    generate_shapes_dataset(args.data_root, **cfg.shapes_spec)
    if args.pretrain:
        spec = demo.load_config(demo.classifier_config()).shape_crops_spec
        generate_shape_crops(args.pretrain_data_root, **spec)


def main(argv=None):
    from tqdm import tqdm

    args = parse_args(argv)
    start_time = time.time()
    cfg = demo.build_config(demo.parse_args(
        ['--model', args.model, '--data-root', args.data_root] +
        (['--iters', str(args.iters)] if args.iters is not None else [])))
    prepare_data(args, cfg)
    starts = ['from scratch'] + ['pretrained'] * args.pretrain
    jobs = [(start, norm, seed) for start in starts for seed in range(args.seeds)
            for norm in NORMS]
    print(f'{len(jobs)} trainings of {args.model}, {args.jobs} at once with {args.threads} '
          f'thread(s) each; logs in {args.work_dir}/<norm>/seed_<k>/', flush=True)
    results = {}  # {(start, norm, seed): metrics}, filled as the trainings finish
    with ThreadPoolExecutor(args.jobs) as pool, tqdm(total=len(jobs), unit='run') as bar:
        futures = {pool.submit(run, args, norm, seed, start): (start, norm, seed)
                   for start, norm, seed in jobs}
        for future in as_completed(futures):
            job = futures[future]
            results[job] = future.result()
            bar.set_postfix_str(f'{job[1]} seed {job[2]} {job[0]}: bbox AP '
                                f'{100 * results[job].get("coco/bbox_mAP", 0.0):.1f}')
            bar.update()
    table = compare({job: results[job] for job in jobs}, TASKS[args.model])
    markdown = format_markdown(table)
    iters = cfg.train_cfg.max_iters
    title = (f'{args.model} PVT-Tiny on synthetic shapes, {iters} iterations, '
             f'{args.seeds} seed(s)')
    with open(osp.join(args.work_dir, 'comparison.md'), 'w') as f:
        f.write(f'{title}: AP (%), mean ± std over the seeds\n\n{markdown}\n')
    with open(osp.join(args.work_dir, 'comparison.json'), 'w') as f:
        json.dump(dict(model=args.model, iters=iters, seeds=args.seeds, threads=args.threads,
                       ap=table, minutes=round((time.time() - start_time) / 60, 1)), f,
                  indent=1)
    png = plot(table, title, osp.join(args.work_dir, 'comparison.png'))
    print(f'\n{title}: AP (%), mean ± std over the seeds\n\n{markdown}\n')
    print(f'total time {(time.time() - start_time) / 60:.1f} min; table, figure and values in '
          f'{args.work_dir} ({osp.basename(png)})')
    return table


if __name__ == '__main__':
    main()
