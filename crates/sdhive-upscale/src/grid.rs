//! A1111's tiled upscale (`upscaler_utils.upscale_with_model` over `images.split_grid` / `combine_grid`): the image
//! cut into overlapping square tiles (the last row and column moved back inside the image, or, for an image
//! smaller than a tile, padded black on the top and left as Pillow's `crop` pads), each tile upscaled on its own
//! as 8-bit RGB, and the tiles put back together with linear feathering over the overlaps: a column ramp across
//! each tile's left overlap, then a row ramp across each row's top overlap, through Pillow's masked paste.

use crate::pillow::{black, crop, paste, paste_masked};
use sdhive_engine::RgbImage;

/// How [`crate::UpscaleModel::upscale`] splits an image: square tiles of `size` pixels overlapping by `overlap`
/// (A1111's `ESRGAN_tile` and `ESRGAN_tile_overlap`); `size` 0 runs the whole image at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tile {
    pub size: u32,
    pub overlap: u32,
}

impl Tile {
    /// A1111's defaults: 192-pixel tiles overlapping by 8.
    pub const A1111: Tile = Tile { size: 192, overlap: 8 };
    /// The whole image in one pass.
    pub const NONE: Tile = Tile { size: 0, overlap: 0 };
}

impl Default for Tile {
    fn default() -> Self {
        Tile::A1111
    }
}

/// One row of tiles: its top edge, height and `(left edge, width, tile)` cells.
struct Row {
    y: i64,
    h: u32,
    cells: Vec<(i64, u32, RgbImage)>,
}

/// `images.Grid`.
struct Grid {
    rows: Vec<Row>,
    tile_h: u32,
    image_w: u32,
    image_h: u32,
    overlap: u32,
}

/// The tile origins along one axis of `len` pixels (A1111: `ceil((len − overlap) / (tile − overlap))` tiles spread
/// evenly, positions truncated, the last one pulled back to end at the edge).
fn origins(len: u32, tile: u32, overlap: u32) -> Vec<i64> {
    let (len, tile, overlap) = (i64::from(len), i64::from(tile), i64::from(overlap));
    let count = ((len - overlap) as f64 / (tile - overlap) as f64).ceil() as i64;
    let step = if count > 1 { (len - tile) as f64 / (count - 1) as f64 } else { 0.0 };
    (0..count.max(0))
        .map(|i| {
            let at = (i as f64 * step) as i64;
            if at + tile >= len {
                len - tile
            } else {
                at
            }
        })
        .collect()
}

fn split_grid(img: &RgbImage, tile: u32, overlap: u32) -> Grid {
    let xs = origins(img.width, tile, overlap);
    let rows = origins(img.height, tile, overlap)
        .into_iter()
        .map(|y| Row {
            y,
            h: tile,
            cells: xs
                .iter()
                .map(|&x| (x, tile, crop(img, x, y, x + i64::from(tile), y + i64::from(tile))))
                .collect(),
        })
        .collect();
    Grid { rows, tile_h: tile, image_w: img.width, image_h: img.height, overlap }
}

/// A1111's feathering ramp: `uint8(float32(i) · 255 / overlap)` for `i` in `0..overlap`.
fn ramp(overlap: u32) -> Vec<u8> {
    (0..overlap).map(|i| (i as f32 * 255.0 / overlap as f32) as u8).collect()
}

fn combine_grid(grid: &Grid) -> RgbImage {
    let o = grid.overlap;
    let ramp = ramp(o);
    // mask_w: the ramp across each of tile_h rows; mask_h: each ramp value across a whole row.
    let mask_w: Vec<u8> = (0..grid.tile_h).flat_map(|_| ramp.iter().copied()).collect();
    let mask_h: Vec<u8> = ramp.iter().flat_map(|&m| std::iter::repeat_n(m, grid.image_w as usize)).collect();
    let mut combined = black(grid.image_w, grid.image_h);
    for row in &grid.rows {
        let mut line = black(grid.image_w, row.h);
        for (x, w, tile) in &row.cells {
            if *x == 0 {
                paste(&mut line, tile, 0, 0);
                continue;
            }
            if o > 0 {
                let left = crop(tile, 0, 0, i64::from(o), i64::from(row.h));
                paste_masked(&mut line, &left, &mask_w[..left.data.len() / 3], *x, 0);
            }
            let rest = crop(tile, i64::from(o), 0, i64::from(*w), i64::from(row.h));
            paste(&mut line, &rest, x + i64::from(o), 0);
        }
        if row.y == 0 {
            paste(&mut combined, &line, 0, 0);
            continue;
        }
        if o > 0 {
            let top = crop(&line, 0, 0, i64::from(line.width), i64::from(o));
            paste_masked(&mut combined, &top, &mask_h, 0, row.y);
        }
        let rest = crop(&line, 0, i64::from(o), i64::from(line.width), i64::from(row.h));
        paste(&mut combined, &rest, 0, row.y + i64::from(o));
    }
    combined
}

/// A1111's `upscale_with_model` with `tile.size > 0`: each tile through `pass`, the outputs joined at the scale
/// of the last tile's output (every tile has the same size, so every output has the same scale).
pub(crate) fn upscale_tiled<E>(
    img: &RgbImage,
    tile: Tile,
    mut pass: impl FnMut(&RgbImage) -> Result<RgbImage, E>,
    bad_tile: impl FnOnce(String) -> E,
) -> Result<RgbImage, E> {
    if tile.overlap >= tile.size {
        return Err(bad_tile(format!(
            "the tile overlap ({}) must be smaller than the tile ({})",
            tile.overlap, tile.size
        )));
    }
    let grid = split_grid(img, tile.size, tile.overlap);
    let mut scale = 1u32;
    let mut rows = Vec::with_capacity(grid.rows.len());
    for row in grid.rows {
        let mut cells = Vec::with_capacity(row.cells.len());
        for (x, w, t) in row.cells {
            let out = pass(&t)?;
            scale = out.width / t.width.max(1);
            cells.push((x, w, out));
        }
        rows.push((row.y, row.h, cells));
    }
    let s = i64::from(scale);
    let scaled = Grid {
        rows: rows
            .into_iter()
            .map(|(y, h, cells)| Row {
                y: y * s,
                h: h * scale,
                cells: cells.into_iter().map(|(x, w, t)| (x * s, w * scale, t)).collect(),
            })
            .collect(),
        tile_h: grid.tile_h * scale,
        image_w: grid.image_w * scale,
        image_h: grid.image_h * scale,
        overlap: grid.overlap * scale,
    };
    Ok(combine_grid(&scaled))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_as_a1111() {
        // 23 px, tiles of 12 overlapping by 4: ceil(19/8) = 3 tiles, step 5.5 → 0, 5, 11.
        assert_eq!(origins(23, 12, 4), vec![0, 5, 11]);
        // An image smaller than a tile: one tile pulled back to end at the edge (padded on the left).
        assert_eq!(origins(17, 192, 8), vec![17 - 192]);
        assert_eq!(origins(184, 192, 8), vec![-8]);
        assert_eq!(origins(200, 192, 8), vec![0, 8]);
        assert_eq!(ramp(4), vec![0, 63, 127, 191]);
    }

    #[test]
    fn identity_tiles_give_the_image_back() {
        let img = RgbImage {
            width: 23,
            height: 17,
            data: (0..23 * 17 * 3).map(|i| (i * 13 % 256) as u8).collect(),
        };
        for tile in [Tile { size: 12, overlap: 4 }, Tile { size: 8, overlap: 0 }, Tile::A1111] {
            let out = upscale_tiled(&img, tile, |t| Ok::<_, String>(t.clone()), |e| e).expect("tiles");
            assert_eq!(out, img, "{tile:?}");
        }
        assert!(upscale_tiled(&img, Tile { size: 4, overlap: 4 }, |t| Ok(t.clone()), |e| e).is_err());
    }
}
