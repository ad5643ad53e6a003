"""`structformer recipes`: the papers' training settings, for `structformer train --recipe NAME`."""
import json

EXAMPLES = """examples:
  structformer recipes
  structformer train --recipe crate_base_in1k --data imagefolder:/data/imagenet --dry-run
  torchrun --nproc_per_node 8 -m structformer train --recipe crate_base_in1k --data imagefolder:/data/imagenet"""


def add_arguments(p) -> None:
    p.add_argument('--json', action='store_true',
                   help='one JSON list: name, paper, source, covers, model, data, reported, sweep, models')


def run(args) -> int:
    from ..train.recipes import recipe_rows
    rows = recipe_rows()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    def short(text: str, width: int) -> str:
        return text if len(text) <= width else text[:width - 1] + '…'
    # what each recipe trains: the table cells it covers, '(+ sweep)' where its rows reach more of them by flags
    table = [{'name': r['name'], 'paper': r['paper'].split(' (')[0], 'model': r['model'],
              'reported': short(r['reported'], 48),
              'covers': r['covers'] + (' (+ sweep)' if r['sweep'] and 'sweep' not in r['covers'] else '')}
             for r in rows]
    columns = ('name', 'paper', 'model', 'reported')
    widths = {c: max(len(c), *(len(t[c]) for t in table)) for c in columns}
    print('  '.join(f"{c:<{widths[c]}}" for c in columns) + '  covers')
    for t in table:
        print('  '.join(f"{t[c]:<{widths[c]}}" for c in columns) + f"  {t['covers']}")
    print(f"\n{len(rows)} recipes; `structformer train --recipe NAME --data ... --dry-run` prints a recipe's plan, "
          "its sweep included (docs/recipes.md)")
    return 0


