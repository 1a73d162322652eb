// The inpainting mask: a canvas of the init image's own size laid over it, painted with pointer events (mouse,
// pen, touch). It is exported as an opaque PNG of that size, white where the image is to be repainted and black
// elsewhere, as the API's `mask` wants it.

export class MaskPainter {
  private ctx: CanvasRenderingContext2D;
  private last: { x: number; y: number } | null = null;
  private painted = false;
  brush = 32;
  erase = false;

  constructor(private readonly canvas: HTMLCanvasElement) {
    const ctx = canvas.getContext('2d');
    if (!ctx) throw new Error('this browser cannot draw on a canvas');
    this.ctx = ctx;
    canvas.addEventListener('pointerdown', (e) => this.down(e));
    canvas.addEventListener('pointermove', (e) => this.move(e));
    canvas.addEventListener('pointerup', (e) => this.up(e));
    canvas.addEventListener('pointercancel', (e) => this.up(e));
  }

  /** Starts an empty mask for an image of this size. */
  reset(width: number, height: number): void {
    this.canvas.width = width;
    this.canvas.height = height;
    this.clear();
  }

  clear(): void {
    this.ctx.clearRect(0, 0, this.canvas.width, this.canvas.height);
    this.painted = false;
  }

  fill(): void {
    this.ctx.globalCompositeOperation = 'source-over';
    this.ctx.fillStyle = '#fff';
    this.ctx.fillRect(0, 0, this.canvas.width, this.canvas.height);
    this.painted = true;
  }

  invert(): void {
    const { width, height } = this.canvas;
    const tmp = document.createElement('canvas');
    tmp.width = width;
    tmp.height = height;
    const t = tmp.getContext('2d');
    if (!t) return;
    t.fillStyle = '#fff';
    t.fillRect(0, 0, width, height);
    t.globalCompositeOperation = 'destination-out';
    t.drawImage(this.canvas, 0, 0);
    this.ctx.globalCompositeOperation = 'source-over';
    this.ctx.clearRect(0, 0, width, height);
    this.ctx.drawImage(tmp, 0, 0);
    this.painted = true;
  }

  /** Whether anything was painted since the last reset or clear. */
  hasMask(): boolean {
    return this.painted;
  }

  /** The mask as a PNG data URL: white = repaint, black = keep; the init image's size. */
  toDataUrl(): string {
    const { width, height } = this.canvas;
    const out = document.createElement('canvas');
    out.width = width;
    out.height = height;
    const o = out.getContext('2d');
    if (!o) throw new Error('this browser cannot draw on a canvas');
    o.fillStyle = '#000';
    o.fillRect(0, 0, width, height);
    o.drawImage(this.canvas, 0, 0);
    return out.toDataURL('image/png');
  }

  private point(e: PointerEvent): { x: number; y: number } {
    const r = this.canvas.getBoundingClientRect();
    return {
      x: ((e.clientX - r.left) / r.width) * this.canvas.width,
      y: ((e.clientY - r.top) / r.height) * this.canvas.height,
    };
  }

  /** The brush is sized in screen pixels, so it feels the same on small and large images. */
  private lineWidth(): number {
    const r = this.canvas.getBoundingClientRect();
    return Math.max(1, (this.brush * this.canvas.width) / Math.max(1, r.width));
  }

  private down(e: PointerEvent): void {
    if (e.button !== 0 && e.pointerType === 'mouse') return;
    e.preventDefault();
    this.canvas.setPointerCapture(e.pointerId);
    this.last = this.point(e);
    this.stroke(this.last, this.last);
  }

  private move(e: PointerEvent): void {
    if (!this.last) return;
    e.preventDefault();
    const p = this.point(e);
    this.stroke(this.last, p);
    this.last = p;
  }

  private up(e: PointerEvent): void {
    if (!this.last) return;
    this.last = null;
    if (this.canvas.hasPointerCapture(e.pointerId)) this.canvas.releasePointerCapture(e.pointerId);
  }

  private stroke(a: { x: number; y: number }, b: { x: number; y: number }): void {
    const c = this.ctx;
    c.globalCompositeOperation = this.erase ? 'destination-out' : 'source-over';
    c.strokeStyle = '#fff';
    c.lineCap = 'round';
    c.lineJoin = 'round';
    c.lineWidth = this.lineWidth();
    c.beginPath();
    c.moveTo(a.x, a.y);
    c.lineTo(b.x + 0.01, b.y);
    c.stroke();
    if (!this.erase) this.painted = true;
  }
}
