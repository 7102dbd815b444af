"""The report page in a real browser: headless Chromium (Debian's `chromium`, installed by tests/run.sh)
loads it with no console errors, shows every image, and renders a screenshot that is not blank.

Set PREPACK_SCREENSHOT_DIR to keep the screenshot for a look.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from test_report import write_manifest, write_metrics

from apps import report

# Runs first in <head>: records uncaught errors, failed loads and console.error/warn calls.
PROBE_HEAD = """<script>
window.__problems = [];
window.addEventListener('error', e => window.__problems.push('error: ' + (e.message || (e.target && (e.target.src || e.target.href)) || e)), true);
window.addEventListener('unhandledrejection', e => window.__problems.push('rejection: ' + e.reason));
for (const level of ['error', 'warn']) {
  const original = console[level].bind(console);
  console[level] = (...args) => { window.__problems.push(level + ': ' + args.join(' ')); original(...args); };
}
</script>"""
# Runs after load: writes what it found into the DOM, which --dump-dom prints.
PROBE_END = """<script>
window.addEventListener('load', () => {
  const images = [...document.images].map(img => ({alt: img.alt, complete: img.complete,
    width: img.naturalWidth, height: img.naturalHeight, shown: img.getBoundingClientRect().width}));
  const pre = document.createElement('pre');
  pre.id = 'probe';
  pre.textContent = JSON.stringify({images, problems: window.__problems});
  document.body.appendChild(pre);
});
</script>"""


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("headless Chromium is needed: apt-get install chromium (bash tests/run.sh does)")
    return path


def browse(args: list[str], url: str) -> subprocess.CompletedProcess:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
           "--allow-file-access-from-files", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    for L, rows in ((256, 40), (512, 20), (1024, 10)):
        write_manifest(root / "packed" / f"L{L}", L, 120, 10_000, 6_000, rows, dropped={"too_long": 3})
    write_manifest(root / "unpacked" / "L512", 512, 120, 10_000, 6_000, 120, packing="unpacked")
    rng = np.random.default_rng(0)
    a = write_metrics(root / "packed.jsonl", [3000] * 12, (0.5 + 0.01 * rng.random(12)).tolist(),
                      losses=(2 + np.exp(-np.arange(12) / 4)).tolist(), summary={"packing": "packed"})
    b = write_metrics(root / "unpacked.jsonl", [600] * 12, (0.5 + 0.01 * rng.random(12)).tolist(),
                      losses=(2 + np.exp(-np.arange(12) / 20)).tolist(), summary={"packing": "unpacked"})
    out = root / "report.html"
    assert report.main(["--shards", str(root / "packed"), str(root / "unpacked" / "L512"),
                        "--metrics", str(a), str(b), "--output", str(out)]) == 0
    return out


def test_report_loads_without_errors_and_shows_every_image(page, tmp_path):
    html = page.read_text()
    probed = tmp_path / "probed.html"
    probed.write_text(html.replace("<head>", "<head>" + PROBE_HEAD, 1).replace("</body>", PROBE_END + "</body>", 1))
    assert "__problems" in probed.read_text() and "id = 'probe'" in probed.read_text()  # both probes went in
    res = browse(["--virtual-time-budget=5000", "--dump-dom"], probed.as_uri())
    assert res.returncode == 0, res.stderr[-2000:]
    marker = '<pre id="probe">'
    assert marker in res.stdout, f"the page did not finish loading: {res.stdout[-500:]} {res.stderr[-1000:]}"
    found = json.loads(res.stdout.split(marker, 1)[1].split("</pre>", 1)[0].replace("&quot;", '"').replace("&amp;", "&"))
    assert found["problems"] == []
    assert len(found["images"]) == html.count("<img ") >= 4
    for img in found["images"]:
        assert img["complete"] and img["width"] > 0 and img["height"] > 0 and img["shown"] > 0, img


def test_report_screenshot_is_not_blank(page, tmp_path):
    shot = tmp_path / "report.png"
    res = browse([f"--screenshot={shot}", "--window-size=1280,2400"], page.as_uri())
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    import matplotlib.image

    pixels = matplotlib.image.imread(str(shot))[..., :3]
    assert pixels.shape[:2] == (2400, 1280)
    not_white = (pixels < 0.95).any(axis=-1).mean()
    assert not_white > 0.02, f"the screenshot is almost blank ({not_white:.1%} of pixels drawn)"
    keep = os.environ.get("PREPACK_SCREENSHOT_DIR")
    if keep:
        os.makedirs(keep, exist_ok=True)
        shutil.copy(shot, os.path.join(keep, "report.png"))
